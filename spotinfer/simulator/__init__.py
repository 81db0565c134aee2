"""A discrete-event simulation of a spot fleet under the coordinator's policies (admission,
routing, staging, migration, recovery, standby spread, on-demand fallback), calibrated from
measurements, for what cannot be measured on one machine: cost and SLA attainment of a fleet
over availability traces. `spotinfer simulate` is its command line."""
