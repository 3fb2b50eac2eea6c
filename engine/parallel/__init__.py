"""Parallelism: the mesh axes as data, the mesh, logical-axis sharding rules, pipeline stages and DiLoCo's replicas."""
