/* A perfectly good shared library that is not a hicache storage plugin (no entry symbol). */
__attribute__((visibility("default"))) int not_a_plugin_answer(void) { return 42; }
