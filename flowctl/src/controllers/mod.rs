//! The controllers, pure where they can be: KLimiter's water-level loop, the
//! CPU signal, and the simulator that runs KLimiter on a modelled plant.
pub mod cpu;
pub mod klimiter;
pub mod simulate;
