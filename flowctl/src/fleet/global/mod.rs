//! Global limits: one limit across every host attached to the same store,
//! as leases kept in Redis (docs/fleet.md, "Global limits").
