"""The cluster's plumbing, under both sides of the split: every Ray role started one way
(`roles.py`), placement groups and the actors' environment (`placement.py`), waiting on actor calls
with deadlines that name the late actor (`calls.py`), what a run asks of the cluster (`cluster.py`),
the watcher that ends a run's processes when its driver dies (`reaper.py`), a model served from
actors of its own (`served.py`). It knows neither the engines nor the learners."""
