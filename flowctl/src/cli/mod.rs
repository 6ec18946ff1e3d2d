//! The command line: one module per verb, and `top`.
pub mod commands;
pub mod doctor;
pub mod top;
