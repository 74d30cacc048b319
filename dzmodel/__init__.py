"""dzmodel: the DreamZero world action model library (model, data, train, eval, serve).

Importable with torch + safetensors + numpy alone: no Prefect, MLflow or DVC imports here.
"""

__version__ = "0.1.0"
