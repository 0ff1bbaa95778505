"""Data: schema, ArrayRecord storage, synthetic ads logs and grain pipelines."""
