"""Routing: the routers, their state, the policies and what requests taught them."""
