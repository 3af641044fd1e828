//! Lab tests on small generated traces.
