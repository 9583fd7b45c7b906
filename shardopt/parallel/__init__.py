"""Who talks to whom: collectives on explicit groups (comm), meshes and hybrid sharding (mesh, mesh_plan),
and the cross-rank agreement checks every constructor runs (consistency)."""
