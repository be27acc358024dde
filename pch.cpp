// Empty: carries the precompiled header that other targets reuse.
