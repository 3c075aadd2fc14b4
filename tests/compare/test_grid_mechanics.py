"""Grids that survive hours and sessions: the pure pieces (revision, CPU kind, pinned worktrees, the grid record's
continuation rules, the primary hypothesis, the convergence criterion, stop rules, checkpoint pruning) without
training; tests/compare/test_grid_runs.py trains tiny grids for extension, mid-run resumption and merging."""

from __future__ import annotations

import math
import multiprocessing
import random
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import klgrad.compare.merge as merge_module
from klgrad.cli import main
from klgrad.compare.claims import Claim, parse_claim
from klgrad.compare.convergence import (
    ConvergenceCriterion,
    MethodRuns,
    converged,
    logged_densely,
    lr_decays,
    window_halves,
)
from klgrad.compare.convergence_plot import verdict_text
from klgrad.compare.design import GridMismatchError, allowed_seeds, amend_seeds, registered_seeds, settle_design
from klgrad.compare.hypotheses import (
    PREDICTIONS,
    amended_primary,
    check_logged,
    grid_convergence,
    prediction_tests,
    summarize,
)
from klgrad.compare.merge import add_new_files, check_mergeable, remove_created
from klgrad.compare.options import parse_seed_list
from klgrad.compare.provenance import (
    PIN_DIR_ENV,
    PIN_ENV,
    Revision,
    check_pinned,
    parse_cpuinfo,
    pin_worktree,
    pinned_command,
    revision_name,
    same_code,
    source_revision,
    strip_pin_args,
)
from klgrad.compare.records import GridRecord, Summary
from klgrad.compare.render import convergence_markdown, summary_markdown
from klgrad.compare.stats import decide
from klgrad.runlock import waiting_lock
from klgrad.stopping import parse_stop_rule, stop_point
from klgrad.trainer.checkpoints import prune_checkpoints
from tests.helpers.tiny_runs import small

# ----------------------------------------------------------------------------------------------------------
# revision and machine


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(cwd), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


@pytest.fixture
def repo(tmp_path) -> Path:
    """A git repository with a package at src/klgrad, one commit."""
    r = tmp_path / "repo"
    (r / "src" / "klgrad").mkdir(parents=True)
    (r / "src" / "klgrad" / "__init__.py").write_text("X = 1\n")
    (r / ".gitignore").write_text("runs/\n")
    git(r, "init", "-q")
    git(r, "add", ".")
    git(r, "commit", "-qm", "one")
    return r


def test_revision_names_the_commit_and_hashes_uncommitted_changes(repo):
    src = repo / "src" / "klgrad"
    sha = git(repo, "rev-parse", "HEAD")
    clean = source_revision(src)
    assert (clean.name, clean.commit, clean.dirty) == (sha, sha, False)
    (src / "__init__.py").write_text("X = 2\n")
    a = source_revision(src)
    assert a.dirty
    assert a.commit == sha
    assert a.name.startswith(f"{sha}-dirty-")
    assert len(a.name) == len(sha) + 19
    (src / "__init__.py").write_text("X = 3\n")
    assert source_revision(src).name != a.name  # other edits on the same commit: another revision
    (src / "__init__.py").write_text("X = 1\n")
    (repo / "runs").mkdir()
    (repo / "runs" / "log").write_text("ignored\n")
    assert source_revision(src) == clean  # ignored files are not code
    (src / "new.py").write_text("Y = 1\n")  # untracked under the package: importable, so dirty
    assert source_revision(src).dirty
    assert source_revision(src).content != clean.content  # the package's files changed
    assert revision_name(sha, b"") == sha
    (src / "new.py").unlink()
    (repo / "README").write_text("docs only\n")
    git(repo, "add", "README")
    docs_only = source_revision(src)
    assert docs_only.dirty
    assert docs_only.content == clean.content  # dirty, but the package's own files are the commit's
    assert same_code(docs_only.as_dict(), clean.as_dict())


def test_a_copy_without_git_runs_the_same_code_as_its_commit(repo, tmp_path):
    src = repo / "src" / "klgrad"
    copy = tmp_path / "copy" / "klgrad"
    shutil.copytree(src, copy)  # what a machine gets when the tree is copied without .git
    there = source_revision(copy)
    assert there.name.startswith("klgrad-")
    assert there.commit is None
    here = source_revision(src)
    assert same_code(there.as_dict(), here.as_dict())
    old = settle_design(None, record(here.name) | {"revision": here.as_dict()}, has_runs=False)
    assert settle_design(old, record() | {"revision": there.as_dict()}, has_runs=True)["revision"] == here.as_dict()
    (copy / "__init__.py").write_text("X = 2\n")
    edited = source_revision(copy)
    assert edited.name == there.name  # both git-less copies: one name...
    assert not same_code(edited.as_dict(), there.as_dict())  # ...but not the same code
    with pytest.raises(GridMismatchError, match="Runs of one grid must share one revision"):
        settle_design(old, record() | {"revision": source_revision(copy).as_dict()}, has_runs=True)


def test_outside_git_the_revision_is_the_version(tmp_path):
    rev = source_revision(tmp_path)
    assert rev.name.startswith("klgrad-")
    assert rev.commit is None
    assert not rev.dirty


def test_cpu_kind_from_cpuinfo():
    text = (
        "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8488C\nflags\t\t: fpu sse avx2 avx512f avx512bw\n\n"
        "processor\t: 1\nmodel name\t: Intel(R) Xeon(R) Platinum 8488C\nflags\t\t: fpu sse avx2 avx512f avx512bw\n"
    )
    assert parse_cpuinfo(text) == {"model": "Intel(R) Xeon(R) Platinum 8488C", "cores": 2, "avx2": True, "avx512": True}
    amd = "processor : 0\nmodel name : AMD EPYC 7B13\nflags : fpu avx avx2 fma\n"
    assert parse_cpuinfo(amd)["avx512"] is False
    assert parse_cpuinfo(amd)["avx2"] is True
    assert parse_cpuinfo("processor : 0\nHardware : BCM2835\n")["model"] == "BCM2835"


# ----------------------------------------------------------------------------------------------------------
# pinning


def test_pinned_worktree_is_the_commit_and_the_command_runs_from_it(repo, tmp_path):
    sha = git(repo, "rev-parse", "HEAD")
    (repo / "src" / "klgrad" / "__init__.py").write_text("X = 'edited beside the grid'\n")  # work beside it
    commit, wt = pin_worktree("HEAD", repo / "src" / "klgrad", tmp_path / "pins")
    assert commit == sha
    assert wt == tmp_path / "pins" / sha
    assert (wt / "src" / "klgrad" / "__init__.py").read_text() == "X = 1\n"  # the commit, not the edit
    rev = source_revision(wt / "src" / "klgrad")
    assert rev.name == sha  # what the pinned grid records
    assert pin_worktree(sha[:10], repo, tmp_path / "pins") == (sha, wt)  # reused
    argv = ["--out", "g", "--pin", "HEAD", "--seeds", "8", "--pin=x", "--kl-prompts", "22"]
    cmd, env = pinned_command(wt, commit, argv, {"PYTHONPATH": "/elsewhere", "HOME": "/h"})
    assert cmd == [sys.executable, "-m", "klgrad", "compare", "--out", "g", "--seeds", "8", "--kl-prompts", "22"]
    assert env["PYTHONPATH"] == f"{wt / 'src'}:/elsewhere"
    assert env[PIN_ENV] == sha
    assert env["HOME"] == "/h"
    assert check_pinned(rev, environ={PIN_ENV: sha})
    assert not check_pinned(rev, environ={})
    with pytest.raises(ValueError, match="PYTHONPATH must put the pinned worktree"):
        check_pinned(Revision("other", "other", False, "/x"), environ={PIN_ENV: sha})
    (wt / "src" / "klgrad" / "__init__.py").write_text("X = 'edited in the pin'\n")
    with pytest.raises(ValueError, match="not the clean commit"):
        pin_worktree("HEAD", repo, tmp_path / "pins")
    assert pin_worktree("HEAD", repo, tmp_path / "pins", allow_dirty=True) == (sha, wt)
    shutil.rmtree(wt)  # deleted by hand: made again (the stale registration pruned)
    assert pin_worktree("HEAD", repo, tmp_path / "pins") == (sha, wt)
    with pytest.raises(ValueError, match="not a commit"):
        pin_worktree("no-such-rev", repo, tmp_path / "pins")
    assert strip_pin_args(["--pin", "a", "--x", "--pin=b"]) == ["--x"]


def pin_or_error(repo_and_root: tuple[Path, Path]) -> str:
    """One process's pin_worktree, its failure as text (a pool's worker must return, not raise)."""
    try:
        return pin_worktree("HEAD", *repo_and_root)[0]
    except ValueError as e:
        return f"error: {e}"


def test_processes_pinning_at_once_all_get_the_whole_clean_worktree(repo, tmp_path):
    # A GPU machine starts one `klgrad compare --pin` per (seed, method) at once. Unserialised, the ones that found
    # the folder while another was still checking it out read it as dirty (2 of 16 on 2026-11-27). Many files make
    # the checkout slow enough for that window to be hit here.
    for i in range(400):
        (repo / "src" / "klgrad" / f"m{i}.py").write_text(f"Y = {i}\n")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "many files")
    sha = git(repo, "rev-parse", "HEAD")
    with multiprocessing.get_context("fork").Pool(8) as pool:
        got = pool.map(pin_or_error, [(repo, tmp_path / "pins")] * 8, chunksize=1)
    assert got == [sha] * 8


def test_a_pin_waits_while_another_process_holds_the_pin_lock(repo, tmp_path):
    sha = git(repo, "rev-parse", "HEAD")
    done: list = []
    with waiting_lock(tmp_path / "pins" / ".pin.lock"):
        t = threading.Thread(target=lambda: done.append(pin_worktree("HEAD", repo, tmp_path / "pins")))
        t.start()
        t.join(timeout=0.5)
        assert t.is_alive()
        assert not done
        assert not (tmp_path / "pins" / sha).exists()
    t.join(timeout=60)
    assert done == [(sha, tmp_path / "pins" / sha)]


def test_cli_pin_reexecutes_compare_from_the_pinned_worktree(repo, tmp_path, monkeypatch):
    from klgrad.compare import provenance

    monkeypatch.setattr(provenance, "package_source", lambda: repo / "src" / "klgrad")
    monkeypatch.setenv(PIN_DIR_ENV, str(tmp_path / "pins"))
    calls = []
    monkeypatch.setattr("os.execve", lambda path, argv, env: calls.append((path, argv, env)))
    sha = git(repo, "rev-parse", "HEAD")
    assert main(["compare", "--pin", "HEAD", "--out", str(tmp_path / "g"), "--seeds", "8"]) == 0
    ((path, argv, env),) = calls
    assert path == sys.executable
    assert argv[1:] == ["-m", "klgrad", "compare", "--out", str(tmp_path / "g"), "--seeds", "8"]
    assert env["PYTHONPATH"].split(":")[0] == str(tmp_path / "pins" / sha / "src")
    assert env[PIN_ENV] == sha
    assert not (tmp_path / "g").exists()  # nothing ran in this process


# ----------------------------------------------------------------------------------------------------------
# the grid record: continuation rules


def record(revision: str = "abc", **over) -> dict:
    base = {
        "revision": {"revision": revision, "commit": revision, "dirty": False, "source": "/src/klgrad"},
        "pinned": False,
        "created": "2026-11-26T00:00:00+00:00",
        "config": "configs/tiny_add.yaml",
        "resolved_config": {"rollout": {"temperature": 1.0}},
        "methods": ["k2_as_loss", "k3_as_loss"],
        "seeds": 4,
        "betas": [0.5],
        "level": "sequence",
        "steps": 10,
        "cadence_steps": 10,
        "overrides": {},
        "margin": 0.1,
        "exact_prompts": 3,
        "estimate_samples": 4,
        "primary": None,
        "convergence": None,
        "session": {"at": "now"},
    }
    return {**base, **over}


def test_a_continuation_at_another_revision_is_refused_naming_both():
    old = settle_design(None, record("aaa111"), has_runs=False)
    with pytest.raises(
        GridMismatchError, match=r"run at revision aaa111; this klgrad \(/src/klgrad\) is bbb222.*--pin aaa111"
    ):
        settle_design(old, record("bbb222"), has_runs=True)
    dirty = settle_design(None, record("aaa111-dirty-0123456789ab"), has_runs=False)
    dirty["revision"]["dirty"] = True
    with pytest.raises(GridMismatchError, match="dirty tree, which cannot be recreated"):
        settle_design(dirty, record("aaa111"), has_runs=True)


def test_a_pinned_grid_refuses_a_dirty_tree_unless_allowed():
    old = settle_design(None, record("aaa111") | {"pinned": True}, has_runs=False)
    dirty = record("aaa111-dirty-0123456789ab")
    dirty["revision"] |= {"commit": "aaa111", "dirty": True}
    old["revision"]["content"] = dirty["revision"]["content"] = "c" * 64  # only files outside the package changed
    with pytest.raises(GridMismatchError, match=r"is a pinned grid and this klgrad .* is a dirty tree"):
        settle_design(old, dirty, has_runs=True)
    assert settle_design(old, dirty, has_runs=True, allow_dirty=True)["revision"] == old["revision"]
    assert settle_design(old | {"pinned": False}, dirty, has_runs=True)["sessions"]  # unpinned: same code suffices


def test_a_continuation_may_extend_and_add_seeds_but_not_change_the_design():
    old = settle_design(None, record(primary=parse_claim("k2_as_loss<k3_as_loss").as_dict()), has_runs=False)
    old = amend_seeds(old, 8, "more seeds", [0, 1], "abc", "2026-11-27T00:00:00+00:00")  # a primary: declared
    longer = settle_design(old, record(steps=20, seeds=8, methods=["k2_as_loss", "none"]), has_runs=True)
    assert longer["steps"] == 20
    assert longer["seeds"] == 8
    assert longer["amendments"] == old["amendments"]  # kept by every continuation
    assert longer["methods"] == ["k2_as_loss", "k3_as_loss", "none"]
    assert longer["primary"] == old["primary"]  # omitted: the record's
    assert len(longer["sessions"]) == 2
    with pytest.raises(GridMismatchError, match="would shorten it"):
        settle_design(old, record(steps=5), has_runs=True)
    for field, value in (("level", "token"), ("betas", [0.1]), ("overrides", {"optim.lr": 1e-5}), ("margin", 0.2)):
        with pytest.raises(GridMismatchError, match=f"records {field} = "):
            settle_design(old, record(**{field: value}), has_runs=True)
    with pytest.raises(GridMismatchError, match="records primary"):
        settle_design(old, record(primary=parse_claim("k3_as_loss<k2_as_loss").as_dict()), has_runs=True)


AT = ("2026-11-27T00:00:00+00:00", "2026-11-28T00:00:00+00:00")


def test_seeds_past_the_registered_count_of_a_primary_grid_need_an_amendment_declared_before_they_run():
    stated = parse_claim("k2_as_loss<k3_as_loss").as_dict()
    old = settle_design(None, record(primary=stated), has_runs=False)  # 4 seeds registered
    with pytest.raises(GridMismatchError, match=r"registered with 4 seeds .* amend --out .* --seeds 8 --reason"):
        settle_design(old, record(seeds=8), has_runs=True)
    assert settle_design(old, record(seeds=8), has_runs=False)["seeds"] == 8  # before any run the design may change
    free = settle_design(None, record(), has_runs=False)  # no primary: seeds are added freely
    assert settle_design(free, record(seeds=8), has_runs=True)["seeds"] == 8
    assert "amendments" not in settle_design(free, record(seeds=8), has_runs=True)  # nothing added to a plain grid

    once = amend_seeds(old, 8, " the se bound needs more seeds ", [0, 1, 2], "def", AT[0])
    assert once["seeds"] == 8
    assert once["amendments"] == [
        {"at": AT[0], "revision": "def", "seeds_from": 4, "seeds_to": 8, "seeds_started": [0, 1, 2],
         "reason": "the se bound needs more seeds"}
    ]  # fmt: skip
    assert settle_design(once, record(seeds=8), has_runs=True)["seeds"] == 8
    with pytest.raises(GridMismatchError, match="registered with 8 seeds"):
        settle_design(once, record(seeds=9), has_runs=True)
    twice = amend_seeds(once, 12, "again", list(range(8)), "def", AT[1])
    assert (registered_seeds(twice), allowed_seeds(twice)) == (4, 12)  # the verdict's seeds stay the first count
    assert (registered_seeds(old), allowed_seeds(old)) == (4, 4)

    for bad, match in (
        (lambda: amend_seeds(free, 8, "why", [], "d", AT[0]), "no primary hypothesis"),
        (lambda: amend_seeds(old, 8, "  ", [], "d", AT[0]), "--reason"),
        (lambda: amend_seeds(once, 8, "why", [], "d", AT[0]), "already has 8 seeds"),
        (lambda: amend_seeds(old, 8, "why", [0, 5], "d", AT[0]), r"seeds \[5\] .* must be declared before they run"),
    ):
        with pytest.raises(GridMismatchError, match=match):
            bad()


def test_a_merge_of_a_primary_grid_keeps_its_seed_count_unless_amended(tmp_path):
    import json

    from klgrad.compare.design import write_json
    from klgrad.compare.merge import merge_grids

    stated = parse_claim("k2_as_loss<k3_as_loss").as_dict()
    crit = ConvergenceCriterion().as_dict()
    registered = settle_design(None, record(primary=stated, convergence=crit), has_runs=False)
    more = settle_design(None, record(primary=stated, seeds=8, convergence=crit), has_runs=False)  # --seeds 8
    with pytest.raises(GridMismatchError, match=r"b records 8 seeds; .* may have 4: declare the amendment"):
        check_mergeable([(Path("a"), registered), (Path("b"), more)])
    amended = amend_seeds(registered, 8, "why", [0], "d", AT[0])
    check_mergeable([(Path("a"), amended), (Path("b"), more)])  # the amendment in either record allows it
    check_mergeable([(Path("b"), more), (Path("a"), amended)])
    for name, rec in (("a", amended), ("b", more)):
        (tmp_path / name).mkdir()
        write_json(tmp_path / name / "grid.json", {k: v for k, v in rec.items() if k != "session"})
    merge_grids([tmp_path / "b"], tmp_path / "a")  # into the amended grid: its amendment is kept
    assert json.loads((tmp_path / "a" / "grid.json").read_text())["amendments"] == amended["amendments"]
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["amendments"] == amended["amendments"]
    plain = [(Path(x), settle_design(None, record(seeds=n), has_runs=False)) for x, n in (("a", 4), ("b", 8))]
    check_mergeable(plain)  # no primary: seeds merge freely


def test_an_amended_grid_decides_its_primary_on_the_registered_seeds_and_reports_every_seed_beside_it():
    methods = ("none", "k2_as_loss", "k3_as_loss")
    results = _grid_results(seeds=8)
    for r in results:  # seeds 6 and 7 reverse the ordering: the all-seed test differs from the registered one
        if r["seed"] >= 6 and r["method"] == "k3_as_loss":
            r["exact_kl"] -= 0.9
    claim = parse_claim("k2_as_loss<k3_as_loss:kl")
    rec = amend_seeds(
        record(primary=claim.as_dict(), seeds=6, methods=list(methods)), 8, "why", list(range(6)), "d", AT[0]
    )
    summary = summarize(results, methods, (0.5,), "sequence", 10, 8, primary=claim)
    out = amended_primary(summary, results, GridRecord.from_json(rec))
    alone = summarize([r for r in results if r["seed"] < 6], methods, (0.5,), "sequence", 10, 6, primary=claim)
    assert out["registered_seeds"] == 6
    assert list(out["amendments"]) == rec["amendments"]
    assert out["primary"] == alone.primary  # exactly the registered test
    assert out["primary"].n_pairs == 6
    assert out["primary"].verdict == "supported"
    assert out["primary_all_seeds"].n_pairs == 8
    assert out["primary_all_seeds"].mean_difference == summary.primary.mean_difference
    assert out["primary_all_seeds"].family.startswith("every seed")
    early = [r for r in results if r["seed"] < 6]
    before = amended_primary(alone, early, GridRecord.from_json(rec))  # no added seed finished yet
    assert before == {"amendments": tuple(rec["amendments"]), "registered_seeds": 6}
    import dataclasses

    md = summary_markdown(dataclasses.replace(summary, **out))
    assert "| registered seeds | k2_as_loss ends below k3_as_loss on kl |" in md
    assert "| every seed (not the verdict) |" in md
    assert "seeds 6 → 8, declared when seeds 0, 1, 2, 3, 4, 5 had started. why" in md


def test_amend_seeds_on_the_command_line_records_the_amendment_or_refuses_with_exit_2(tmp_path):
    import json

    from klgrad.compare.design import write_json

    out = tmp_path / "g"
    (out / "runs" / "k2_as_loss-beta0.5-seed1").mkdir(parents=True)
    (out / "runs" / "k3_as_loss-beta0.5-seed3").mkdir()
    (out / "runs" / "unrelated-seed9").mkdir()
    rec = settle_design(None, record(primary=parse_claim("k2_as_loss<k3_as_loss").as_dict()), has_runs=False)
    write_json(out / "grid.json", {k: v for k, v in rec.items() if k != "session"} | {"convergence": None})
    rec = json.loads((out / "grid.json").read_text())
    rec["convergence"] = ConvergenceCriterion().as_dict()
    write_json(out / "grid.json", rec)
    assert main(["compare", "--out", str(out), "--amend-seeds", "8"]) == 2  # no reason (the older form of `amend`)
    assert main(["compare", "--out", str(out), "--amend-seeds", "8", "9", "--reason", "x"]) == 2  # a stray "9"
    assert json.loads((out / "grid.json").read_text())["seeds"] == 4  # nothing amended
    assert main(["compare", "--out", str(out), "--amend-seeds", "8", "--reason", "the se bound"]) == 0
    grid = json.loads((out / "grid.json").read_text())
    assert grid["seeds"] == 8
    assert grid["amendments"][0] | {"at": None, "revision": None} == {
        "at": None, "revision": None, "seeds_from": 4, "seeds_to": 8, "seeds_started": [1, 3], "reason": "the se bound"
    }  # fmt: skip
    assert json.loads((out / "summary.json").read_text())["amendments"] == grid["amendments"]
    assert main(["compare", "--out", str(out), "--amend-seeds", "8", "--reason", "x"]) == 2  # nothing to add
    assert main(["compare", "--out", str(tmp_path / "none"), "--amend-seeds", "8", "--reason", "x"]) == 2


def test_a_primary_hypothesis_cannot_be_added_once_runs_exist():
    stated = parse_claim("k2_as_loss<k3_as_loss:kl").as_dict()
    old = settle_design(None, record(), has_runs=False)
    with pytest.raises(GridMismatchError, match="would not be pre-registered"):
        settle_design(old, record(primary=stated), has_runs=True)
    with pytest.raises(GridMismatchError, match="would not be pre-registered"):
        settle_design(None, record(primary=stated), has_runs=True)  # a folder of runs from before grid.json
    assert settle_design(old, record(primary=stated), has_runs=False)["primary"] == stated


# ----------------------------------------------------------------------------------------------------------
# the primary hypothesis


def test_claim_syntax():
    assert parse_claim("k2_as_loss<k3_as_loss:kl") == Claim("k2_as_loss", "k3_as_loss", "less", "kl")
    assert parse_claim(" k2_as_loss < k3_as_loss ") == Claim("k2_as_loss", "k3_as_loss", "less", "kl")
    assert parse_claim("k1_as_loss~none:exact_kl") == Claim("k1_as_loss", "none", "equivalent", "exact_kl")
    assert parse_claim("k2_as_loss<my.heads:k5") == Claim("k2_as_loss", "my.heads:k5", "less", "kl")
    assert parse_claim("k2_as_loss<my.heads:k5:logp_gap").metric == "logp_gap"
    for bad in ("k2_as_loss", "a<b<c", "<b", "a~b<c", "a<b:c:d:e"):
        with pytest.raises(ValueError, match="expected 'A<B"):
            parse_claim(bad)


def _grid_results(seeds: int = 6) -> list[dict]:
    """final.json-like rows: k2 below k3 by 0.3 ± 0.01 in every seed, none far above; a seed block effect."""
    rng = random.Random(7)
    out = []
    for s in range(seeds):
        block = rng.gauss(1.0, 0.5)
        for m, shift in (("none", 1.0), ("k2_as_loss", 0.0), ("k3_as_loss", 0.3)):
            kl = block + shift + rng.gauss(0, 0.01)
            row = {"method": m, "beta": 0.5, "seed": s, "exact_kl": kl, "logp_gap": kl / 10}
            row |= {"reward_std_in_group": 0.4 + rng.gauss(0, 0.01), "objective": {"kl_to_optimum": kl / 2}}
            out.append(row)
    return out


def test_the_primary_hypothesis_is_tested_alone_and_the_rest_is_a_secondary_family():
    methods = ("none", "k2_as_loss", "k3_as_loss")
    results = _grid_results()
    claim = parse_claim("k2_as_loss<k3_as_loss:kl")
    summary = summarize(results, methods, (0.5,), "sequence", 10, 6, primary=claim)
    md = summary_markdown(summary)
    summary = summary.to_json()
    p = summary["primary"]
    assert p["text"] == "k2_as_loss<k3_as_loss:kl"
    assert p["family"].startswith("primary")
    assert p["metric"] == "exact_kl"
    assert p["verdict"] == "supported"
    assert p["p_adjusted"] == p["p_value"]  # alone: no adjustment
    kept = [c for c in PREDICTIONS if {c[2], c[3]} <= set(methods) and c[0] != "k2_as_loss keeps KL below k3_as_loss"]
    assert [q["claim"] for q in summary["predictions"]] == [c[0] for c in kept]
    assert all(q["family"] == "secondary" for q in summary["predictions"])
    secondary = decide(prediction_tests(results, methods, 0.5, "exact_kl", exclude=claim))
    assert [q["p_adjusted"] for q in summary["predictions"]] == [q["p_adjusted"] for q in secondary]
    assert "## The primary hypothesis (pre-registered, tested alone)" in md
    assert "## The predictions (secondary)" in md
    assert "one secondary family of the" in md
    named = summarize(
        results, methods, (0.5,), "sequence", 10, 6, primary=parse_claim("k2_as_loss<k3_as_loss:exact_kl")
    ).to_json()
    assert [q["claim"] for q in named["predictions"]] == [c[0] for c in kept]  # kl and exact_kl: the same claim
    # a primary claim that is not among the predictions leaves every prediction secondary
    other = summarize(results, methods, (0.5,), "sequence", 10, 6, primary=parse_claim("none<k3_as_loss:logp_gap"))
    other = other.to_json()
    assert len(other["predictions"]) == len(kept) + 1
    assert other["primary"]["verdict"] == "opposite"


# ----------------------------------------------------------------------------------------------------------
# the convergence criterion


def _series(values, steps=None):
    steps = steps or range(1, len(values) + 1)
    return list(zip(steps, values, strict=True))


def _decaying_lr(n: int) -> list[tuple[int, float]]:
    """Constant, then linear decay over the last third."""
    return [(t, 1e-5 if t <= 2 * n / 3 else 1e-5 * (n - t + 1) / (n / 3)) for t in range(1, n + 1)]


def _runs(seeds: int, n: int, level, noise: float, slope: float = 0.0, rng_seed: int = 3):
    rng = random.Random(rng_seed)
    return [_series([level + slope * t + rng.gauss(0, noise) for t in range(1, n + 1)]) for _ in range(seeds)]


def test_convergence_met_by_flat_precise_runs_with_a_decaying_lr():
    crit = ConvergenceCriterion(gap=0.08)
    n, seeds = 40, 8
    out = converged(_runs(seeds, n, 0.3, noise=0.02), [_decaying_lr(n)] * seeds, crit)
    assert out["met"], out
    assert out["dense"]
    assert out["lr_decays"]
    assert abs(out["moved"]) <= 2 * out["se"]
    assert out["se"] <= 0.02
    assert "at most 0.25 × the stated gap 0.08" in crit.text()


def test_an_amended_grid_decides_convergence_once_at_its_amended_seed_count_not_at_the_first_merge_that_passes():
    n, crit = 40, ConvergenceCriterion(gap=0.08)
    plain = record(convergence=crit.as_dict(), steps=n, seeds=12)
    amended = GridRecord.from_json(
        amend_seeds({**plain, "seeds": 4, "primary": "a<b:kl"}, 12, "se bound", [0, 1], "abc", AT[0])
    )
    plain = GridRecord.from_json(plain)

    def data(seeds: int) -> dict[str, MethodRuns]:
        runs = MethodRuns(_runs(seeds, n, 0.3, noise=0.02), [_decaying_lr(n)] * seeds, list(range(seeds)))
        return {"a": runs, "b": runs}

    assert grid_convergence(data(8), plain).met is True  # a grid never amended: decided on what it has
    typed = grid_convergence(data(8), amended)
    interim = typed.to_json()
    assert interim["met"] is None  # 8 of 12 seeds: the test passes, but it is not the verdict yet
    assert interim["so_far"] == {"met": True, "seeds": 8}
    assert interim["decided_at_seeds"] == 12
    holder = Summary("sequence", n, 8, (0.5,), "exact_kl", None, {}, (), convergence=typed)
    assert "not decided yet (decided once, at 12 seeds" in "\n".join(convergence_markdown(holder))
    assert verdict_text(interim) == "not decided (8 of 12 seeds; the test passes so far)"
    final = grid_convergence(data(12), amended).to_json()
    assert final["met"] is True
    assert "so_far" not in final
    assert verdict_text(final) == "met"
    noisy = {m: MethodRuns(_runs(12, n, 0.3, noise=1.0), d.lrs, d.seeds) for m, d in data(12).items()}
    assert grid_convergence(noisy, amended).met is False  # decided at 12, and failed


def test_convergence_not_met_by_a_trend_by_noise_by_sparse_logs_or_a_constant_lr():
    crit = ConvergenceCriterion(gap=0.08)
    n, seeds = 40, 8
    lrs = [_decaying_lr(n)] * seeds
    trending = converged(_runs(seeds, n, 0.3, noise=0.02, slope=-0.01), lrs, crit)
    assert not trending["met"]
    assert abs(trending["moved"]) > 2 * trending["se"]
    noisy = converged(_runs(seeds, n, 0.3, noise=1.0), lrs, crit)
    assert abs(noisy["moved"]) <= 2 * noisy["se"]  # noise passes the movement test...
    assert not noisy["met"]
    assert noisy["se"] > 0.02
    assert converged(_runs(seeds, n, 0.3, noise=1.0), lrs, ConvergenceCriterion(gap=None))["met"]  # no gap stated
    sparse = [[(t, x) for t, x in s if t % 8 == 0] for s in _runs(seeds, n, 0.3, noise=0.02)]
    assert not converged(sparse, lrs, crit)["dense"]
    constant = [[(t, 1e-5) for t in range(1, n + 1)]] * seeds
    flat = _runs(seeds, n, 0.3, noise=0.02)
    assert not converged(flat, constant, crit)["met"]
    assert converged(flat, constant, ConvergenceCriterion(gap=0.08, lr_decay=None))["met"]
    assert not converged(flat[:1], lrs[:1], crit)["met"]  # one seed has no standard error


def test_convergence_pieces():
    assert logged_densely(_series([1.0] * 10, range(10, 101, 10)), 0.1)
    assert not logged_densely(_series([1.0] * 9, [10, 20, 30, 40, 50, 60, 70, 80, 100]), 0.1)
    assert window_halves(_series([0.0] * 6 + [1.0, 1.0, 3.0, 3.0]), 0.4) == (1.0, 3.0)
    assert window_halves(_series([1.0, 2.0]), 0.25) is None  # no point in the first half
    assert lr_decays([(1, 1.0), (2, 1.0), (3, 0.5)], 1 / 3)
    assert not lr_decays([(1, 1.0), (2, 0.5), (3, 0.6)], 2 / 3)


# ----------------------------------------------------------------------------------------------------------
# stop rules, pruning, seed lists


def test_stop_rule_syntax_and_first_stop():
    rule = parse_stop_rule("kl/k1 > 0.5 for 2")
    assert (rule.metric, rule.op, rule.value, rule.times) == ("kl/k1", ">", 0.5, 2)
    recs = [{"step": 0, "kl/k1": 9}, {"step": 1, "kl/k1": 0.6}, {"step": 2, "kl/k1": 0.4}, {"step": 3, "kl/k1": 0.7}]
    assert stop_point(recs, rule) is None
    recs.append({"step": 4, "kl/k1": 0.8})
    assert stop_point(recs, rule) == {"criterion": "kl/k1 > 0.5 for 2", "step": 4, "value": 0.8}
    ev = parse_stop_rule("eval/greedy_accuracy>=0.9")
    assert stop_point([{"step": 0, "eval/greedy_accuracy": 1.0}, {"step": 2, "eval/greedy_accuracy": None}], ev) is None
    for bad in ("kl/k1 >> 1", "kl/k1 > x", "kl/k1 > 1 for 0", "> 1"):
        with pytest.raises(ValueError, match="METRIC OP VALUE"):
            parse_stop_rule(bad)


def test_prune_keeps_the_newest_complete_checkpoints(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        (root / f"step_{step:06d}").mkdir(parents=True)
        (root / f"step_{step:06d}" / "checksums.json").write_text("{}")
    (root / "step_000008").mkdir()  # torn: no checksums.json, neither counted nor deleted
    deleted = prune_checkpoints(tmp_path, 1)
    assert [p.name for p in deleted] == ["step_000002", "step_000004"]
    assert sorted(p.name for p in root.iterdir()) == ["step_000006", "step_000008"]


def test_seed_lists():
    assert parse_seed_list("4-7") == (4, 5, 6, 7)
    assert parse_seed_list("0,2,5") == (0, 2, 5)
    assert parse_seed_list("0-1,5,1") == (0, 1, 5)
    with pytest.raises(ValueError, match="--only-seeds"):
        parse_seed_list("a-b")


def test_cli_refuses_a_bad_primary_or_seed_list_before_any_run(tmp_path, capsys):
    out = tmp_path / "g"
    assert main(["compare", "--out", str(out), "--methods", "k2_as_loss,k3_as_loss", "--primary", "k2_as_loss<k4"]) == 2
    assert "needs two different methods" in capsys.readouterr().err
    assert main(["compare", "--out", str(out), "--primary", "k2_as_loss<k3_as_loss:nope"]) == 2
    assert "metric 'nope'" in capsys.readouterr().err
    for bad in (["--only-seeds", "x"], ["--final-hook", "nohook"]):  # argparse errors: exit 2 naming the flag
        with pytest.raises(SystemExit) as exit_:
            main(["compare", "--out", str(out), *bad])
        assert exit_.value.code == 2
        assert f"argument {bad[0]}" in capsys.readouterr().err
    assert main(["compare", "--out", str(out), "--seeds", "4", "--only-seeds", "3-5"]) == 2
    assert "not all among the grid's seeds 0..3" in capsys.readouterr().err
    assert main(["compare", "--out", str(out), "--converge-metric", "kl/stepwise"]) == 2  # a metric the runs won't log
    assert "pass --train.log_stepwise_kl true" in capsys.readouterr().err
    assert not out.exists()


def _cosine_lr(n: int) -> list[tuple[int, float]]:
    return [(t, 1e-4 * 0.5 * (1 + math.cos(math.pi * (t - 1) / n))) for t in range(1, n + 1)]


def test_convergence_not_met_by_a_run_the_lr_decay_stopped():
    """A metric that rises while the lr is large and freezes as the cosine schedule decays (the lr, not the
    fixed point, stopped it) passes the end-of-run movement test but fails the same test cut where the lr last is
    at least half its peak; a run that had stopped moving before the decay passes both."""
    n, seeds = 60, 8
    rng = random.Random(5)
    lrs = [_cosine_lr(n)] * seeds
    cum = [sum(x for _, x in _cosine_lr(n)[:t]) / 1e-4 for t in range(1, n + 1)]  # progress ∝ Σ lr
    frozen = [_series([0.01 * c + rng.gauss(0, 0.03) for c in cum]) for _ in range(seeds)]
    out = converged(frozen, lrs, ConvergenceCriterion(gap=0.08))
    assert abs(out["moved"]) <= 2 * out["se"]  # the end of the run looks converged...
    assert out["lr_decays"]
    assert not out["before_decay"]["met"]  # ...but it was still moving at half the peak lr
    assert not out["met"]
    settled = converged(_runs(seeds, n, 0.3, noise=0.02), lrs, ConvergenceCriterion(gap=0.08))
    assert settled["before_decay"]["met"]
    assert settled["met"]
    assert converged(frozen, lrs, ConvergenceCriterion(gap=0.08, before_decay=False))["met"]  # the old criterion


def test_a_criterion_on_the_stepwise_kl_needs_every_run_to_log_it(tmp_path):
    crit = ConvergenceCriterion(gap=0.08, metric="kl/stepwise")
    on, off = small(tmp_path, **{"train.log_stepwise_kl": True}), small(tmp_path)
    check_logged(crit, [on])
    with pytest.raises(ValueError, match=r"logged only with train\.log_stepwise_kl"):
        check_logged(crit, [on, off])
    check_logged(ConvergenceCriterion(gap=0.08), [off])  # kl/k1 is always logged
    check_logged(None, [off])


def tree(root: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and folder (None) under ``root``, by relative path."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def test_files_a_merge_adds_to_a_run_are_listed_before_each_copy_so_a_failed_copy_is_undone(tmp_path, monkeypatch):
    """A run that gained files after it was merged (its downstream evaluation, say): the copy fails on the third
    file. Every folder and file made before the failure is in the list, and removing it leaves the merged run as it
    was; without the failure, the new files arrive and nothing already there is overwritten."""
    run, dest = tmp_path / "lane" / "run", tmp_path / "out" / "run"
    for rel, text in {
        "final.json": "{}",
        "metrics.jsonl": "lane",
        "downstream/a.json": "a",
        "downstream/b.json": "b",
        "downstream/deep/c.json": "c",
    }.items():
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_text(text)
    dest.mkdir(parents=True)
    (dest / "final.json").write_text("{}")
    (dest / "metrics.jsonl").write_text("merged")  # present: never overwritten
    before = tree(dest)
    real_copy, calls = merge_module.shutil.copy2, []

    def failing_copy(src, dst):
        calls.append(dst)
        if len(calls) == 3:
            raise OSError("disk full")
        return real_copy(src, dst)

    monkeypatch.setattr(merge_module.shutil, "copy2", failing_copy)
    created: list[Path] = []
    with pytest.raises(OSError, match="disk full"):
        add_new_files(run, dest, created)
    assert (dest / "downstream" / "a.json").is_file()  # copied before the failure ...
    assert dest / "downstream" / "a.json" in created  # ... and listed, with the folder made for it
    assert dest / "downstream" in created
    remove_created(created)
    assert tree(dest) == before
    monkeypatch.setattr(merge_module.shutil, "copy2", real_copy)
    created = []
    assert sorted(add_new_files(run, dest, created)) == [
        "downstream/a.json",
        "downstream/b.json",
        "downstream/deep/c.json",
    ]
    assert (dest / "metrics.jsonl").read_text() == "merged"
    assert set(created) == {dest / "downstream", dest / "downstream/deep"} | {
        dest / r for r in ("downstream/a.json", "downstream/b.json", "downstream/deep/c.json")
    }
