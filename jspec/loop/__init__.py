"""The speculative loop: drafting (chain/tree), verification, commit, the on-device loop."""
