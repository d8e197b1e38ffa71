"""Publishing (maintainers): the tools that regenerate the book and the data the chapters use.

  regenerate   run every notebook with papermill, in order, killed as a group on failure:
               python -m distlab.publish.regenerate [--profile cpu|gpu|quick] [--only NN]
               (incremental: a chapter whose inputs did not change is not executed again; --force)
  attendee     every chapter's quick profile as a workshop attendee runs it: a normal user, one core each, no
               timeout/ip/tc/Slurm/compiler on PATH; what each chapter skipped (make test-attendee):
               python -m distlab.publish.attendee [--only NN ...]
  book         the command that builds the Jupyter Book offline and checks every page in headless Chromium:
               python -m distlab.publish.book [--check] [--fetch-mathjax]
  book_staging  the book's build input: pages, executed notebooks, figures and tables, the generated
                _toc.yml and results.md (every figure and table with its provenance line)
  book_build   the Sphinx (Jupyter Book 1.x) build of the staged input into HTML, failing on broken pages
  mathjax      a local MathJax (installed from npm once) served from the site, so math renders offline
  site_check   every built page visited in headless chromium (Playwright): images, links, no other host
  datagen      the helpdesk dataset, generated from the tables in data/generator/:
               python -m distlab.publish.datagen [--check]
  dryrun       every profile checked against every chapter without running anything:
               python -m distlab.publish.dryrun [--profile NAME ...]
  profiles     notebooks/profiles.yaml: which parameters each chapter gets under each profile
  freshness    the digest of a chapter's inputs, the stale-output check and the incremental build's cache:
               python -m distlab.publish.freshness check
  pages        the built site pushed to a gh-pages branch with ghp-import, refused when outputs are stale:
               python -m distlab.publish.pages --remote REMOTE   (make publish REMOTE=...)
"""
