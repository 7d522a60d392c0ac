"""What the tests share: the harness that runs ranks (harness), the cases each test runs on its ranks
(*_cases), the rules written plainly (*_reference), and the programs tests launch (*_worker,
slurm_cluster)."""
