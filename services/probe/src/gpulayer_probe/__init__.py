"""gpulayer probe service: publishes what ``gpulayer_detection`` finds as capability events,
re-detects on a timer and sends heartbeats. The service is the ``gpulayer-probe`` console script.
"""
