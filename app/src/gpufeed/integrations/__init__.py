"""Thin adapters for the engines users already run: each writes or reads gpufeed packs
through the public API (gpufeed.Writer, gpufeed.merge), never through format internals.

    gpufeed.integrations.ray.PackSink   a Ray Data Datasink: one part a write task, merged

An engine's own package is imported only by its module here (``import gpufeed`` never
imports Ray).
"""
