fn main() { eprintln!("bench: not yet"); }
