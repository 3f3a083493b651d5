"""The rank side of every backend: the worker body, its process setup, and what it sends back.

Nothing here runs in the caller except to start a rank; everything here runs inside one.
"""
