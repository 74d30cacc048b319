"""Filled by the pipeline issue: Prefect tasks that call dzmodel."""
