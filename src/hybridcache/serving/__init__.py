"""``hybridcache serve``: an OpenAI-compatible HTTP server over the reference engine (needs the
``serve`` extra: FastAPI, uvicorn, prometheus_client).

``ServingRuntime(ServeConfig)`` opens the engine, its loop thread and the tiers;
``create_app(runtime)`` builds the FastAPI app, whose lifespan closes them on shutdown. Routes validate, hand a typed request
to the loop and format the answer; cache and scheduling logic stay in the engine. Nothing is
imported here, so that building the CLI parser never imports the engine or FastAPI.
"""
