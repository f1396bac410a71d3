"""Choosing a policy: :func:`funcamp.search_policy` (``policy_search``).

It finds the cheapest per-module policy whose loss and gradients stay close to float32's. It
works from traces of the loss under candidate policies, and from the gradients' headroom.
"""
