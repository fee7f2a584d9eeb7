"""Mixture of experts: route.py (the router), experts.py (decode and verification's (token,
expert) pairs, few-row products), grouped.py (prefill's pairs grouped by expert)."""
