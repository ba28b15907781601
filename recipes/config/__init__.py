"""The recipe language: the schema, reading TOML with `extends` and overrides, validation, files
and diffs."""
