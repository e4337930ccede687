"""``hybridcache serve``: an OpenAI-compatible HTTP server over the reference engine (needs the
``serve`` extra: FastAPI, uvicorn, prometheus_client).

``create_app(ServeConfig)`` builds the FastAPI app; its lifespan starts the engine loop thread
and stops it (and the tier stores it opened) on shutdown. Routes validate, hand a typed request
to the loop and format the answer; cache and scheduling logic stay in the engine. Nothing is
imported here, so that building the CLI parser never imports the engine or FastAPI.
"""
