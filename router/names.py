"""The names the cluster's named actors are found by (one place: the Router, the consolidation
actor and every client that looks them up read them here)."""

NAMESPACE = "raylane"  # the Ray namespace of every named actor raylane starts
ROUTER_NAME = "raylane-router"
