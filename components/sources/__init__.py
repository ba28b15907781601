"""Raw text sources: files, JSONL / parquet / saved and Hub datasets, read as documents."""
