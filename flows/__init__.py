"""The pipeline as Prefect runs it (sft_pipeline), the DVC path's MLflow run (dvc_tracking), and the `dz` commands
that need Prefect or MLflow (commands)."""
