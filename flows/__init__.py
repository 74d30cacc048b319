"""Filled by the pipeline issue: Prefect flows that call dzmodel."""
