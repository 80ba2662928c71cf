"""The ClientApp: the SuperNode's ``partition-id`` is its client id; it keeps its own examples only."""

from experiments.flower import client_app_for_results

app = client_app_for_results()
