//! The controllers, pure where they can be: KLimiter's water-level loop and
//! the CPU signal. The profile configures them; the agent runs them.
pub mod cpu;
pub mod klimiter;
