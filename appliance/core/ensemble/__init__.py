"""Ensembles: the plan checked at load and the runner that routes each step."""
