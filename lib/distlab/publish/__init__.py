"""Publishing (maintainers): the tools that regenerate the book and the data the chapters use.

  regenerate   run every notebook with papermill, in order, killed as a group on failure:
               python -m distlab.publish.regenerate [--profile cpu|gpu|quick] [--only NN]
  book         build the Jupyter Book offline and check every page in headless Chromium:
               python -m distlab.publish.book [--check]
  datagen      the helpdesk dataset, generated from the tables in data/generator/:
               python -m distlab.publish.datagen [--check]
               (incremental: a chapter whose inputs did not change is not executed again; --force)
  profiles     notebooks/profiles.yaml: which parameters each chapter gets under each profile
  freshness    the digest of a chapter's inputs, the stale-output check and the incremental build's cache:
               python -m distlab.publish.freshness check
  pages        the built site pushed to a gh-pages branch with ghp-import, refused when outputs are stale:
               python -m distlab.publish.pages --remote REMOTE   (make publish REMOTE=...)
  provenance   device, model, world size, commit, date and inputs digest stamped on every figure and table
"""
