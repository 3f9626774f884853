"""Training learned drafters, an application beside :mod:`verispec.bench`: the data sets the target answers
(``verispec drafter-data``: :mod:`~verispec.training.data`, its prompt set :mod:`~verispec.training.prompts`),
the training settings (:mod:`~verispec.training.config`) and loop (``verispec train-drafter``:
:mod:`~verispec.training.train`), and a recipe per learned kind (:mod:`~verispec.training.recipe` and the
kinds' own modules), each named by the kind's entry in the drafter registry."""
