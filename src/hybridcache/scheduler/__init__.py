"""Continuous batching with transactional prefix-cache admission."""

from hybridcache.scheduler.scheduler import Phase, ScheduledBatch, ScheduledChunk, Scheduler, SchedulerConfig, ServingSequence

__all__ = ["Phase", "ScheduledBatch", "ScheduledChunk", "Scheduler", "SchedulerConfig", "ServingSequence"]
