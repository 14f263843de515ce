"""What every stage shares: errors, atomic I/O, manifests, layer ids, targets (finding, identifying, loading,
capturing their hidden states) and the embedded default assets. Nothing here imports a stage."""
