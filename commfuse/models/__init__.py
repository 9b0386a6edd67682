"""Small reference models that the bench, the tests and the examples share (plain ``torch.nn`` modules with
the tensor-parallel plans that parallelize them)."""
