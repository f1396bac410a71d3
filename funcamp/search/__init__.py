"""Choosing a policy: :func:`funcamp.search_policy` (``policy_search``) finds the cheapest
per-module policy whose loss and gradients stay close to float32's, from traces of the loss
under candidate policies and the gradients' headroom."""
