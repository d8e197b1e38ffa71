"""Publishing (maintainers): the tools that regenerate the book and the data the chapters use.

  regenerate   run every notebook with papermill, in order, killed as a group on failure:
               python -m distlab.publish.regenerate [--profile cpu|gpu|quick] [--only NN]
  book         build the Jupyter Book offline and check every page in headless Chromium:
               python -m distlab.publish.book [--check]
  datagen      the helpdesk dataset, generated from the tables in data/generator/:
               python -m distlab.publish.datagen [--check]
  provenance   device, model, world size, commit and date stamped on every figure, table and run
"""
