"""Training on the native engine: the bilingual corpus, the step-by-step trainer the Train page shows, and the
build of the bundled models; it uses the engine's own forward and is used by the command line above it."""
