"""Adapters that put hybridcache under other serving engines (one subpackage per engine).

Each imports its engine lazily and is imported by nothing in the package.
"""
