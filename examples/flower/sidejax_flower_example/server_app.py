"""The ServerApp: the run from Flower's run configuration, results in its ``out`` folder
(experiments/flower.py, which must be importable: the launcher puts the sidejax checkout on PYTHONPATH)."""

from experiments.flower import server_app_for_results

app = server_app_for_results()
