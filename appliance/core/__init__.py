"""The serving core: data plane, model lifecycle, model versions, ensembles,
schedulers (dynamic and sequence batching), instances, the memory budget and
statistics. Knows nothing of any wire protocol."""
