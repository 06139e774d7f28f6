"""The worker process: what each one runs beside its tasks (`steps`, run in order by `process`),
the one module that connects Celery's signals (`signals`), and the fixes to kombu it runs with."""
