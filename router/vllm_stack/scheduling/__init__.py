"""Scheduling: filters -> weighted scorers -> picker, as in the Gateway API Inference Extension EPP.

A strategy is a :class:`~vllm_stack.scheduling.framework.Profile` assembled from small plugins (one
per file under ``plugins/``); adding a strategy means adding a plugin and a profile entry, not editing
an if/else in the proxy.
"""
