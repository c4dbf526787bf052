"""Built-in task families (seeded generators, reference solvers, verifiers)."""
