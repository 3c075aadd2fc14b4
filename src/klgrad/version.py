"""klgrad's version: a leaf module, so that any layer can name it (the run record's ``run.json``)."""

__version__ = "0.1.0"
