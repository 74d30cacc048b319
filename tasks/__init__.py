"""Thin Prefect tasks over dzmodel: one task per pipeline stage (stages), the MLflow run, registry and promotion
(tracking), the registered policy as an MLflow pyfunc model (mlflow_policy), and the flow run's artifacts
(artifacts)."""
