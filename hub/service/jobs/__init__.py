"""A job's life: accepted (submission), admitted (scheduler), run and watched (supervisor), told about
(runner API), shown (views), re-run and compared (reproduction); queues and notebook servers' GPUs.
"""
