"""Everything between a LeRobot dataset on disk and a training batch.

fetch -> LeRobot readers (v2.1, v3.0, image-in-parquet) -> video decode -> embodiments (YAML)
-> window sampling (multi_anchor / fixed_window, mixtures, resumable sharding) -> transforms -> collate.
"""
