"""The Ray placement: the pool's members as Ray actors in a placement group."""
