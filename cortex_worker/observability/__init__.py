"""What Cortex shows other tools: traces, Prometheus metrics, Celery task events (Flower)."""
