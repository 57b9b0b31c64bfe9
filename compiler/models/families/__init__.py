"""One module per model family: its decoder's hooks over base.py and its tiny test config (family.py says what a
file declares); compiler/models/__init__.py lists them in FAMILIES."""
