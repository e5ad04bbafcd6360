//! Lane `egress` in the controller: which claim holds a lane address, and the policy a claim
//! runs under.

use std::net::Ipv4Addr;

use silk_egress::{Egress, Lease, Policy};
use silk_engine::Lane;

use super::*;

impl Node {
    /// The running claim at lane address `addr`, and its policy.
    pub(crate) fn egress_lease(&self, addr: Ipv4Addr) -> Option<Lease> {
        let (sandbox, policy) = {
            let st = self.lock();
            let live = st
                .slots
                .claims()
                .find(|l| l.address == Some(addr) && matches!(l.record.phase, Phase::Running))?;
            (live.record.id.clone(), live.record.egress.clone())
        };
        let policy = policy.and_then(|p| Policy::parse(&p).ok()).unwrap_or_else(Policy::nothing);
        Some(Lease { sandbox, policy: Arc::new(policy) })
    }

    /// Fixes the policy a claim runs under: its pool's (the node's default for a pool that sets
    /// none; nothing when neither does), narrowed by what the claim asked. Only root may ask
    /// for more than the pool allows.
    pub(crate) fn settle_egress(&self, spec: &mut ClaimSpec) -> Result<(), NodeError> {
        if spec.lane == Lane::None {
            if spec.egress.is_some() {
                return Err(NodeError::new(Code::Invalid, "egress is for lane \"egress\" only"));
            }
            return Ok(());
        }
        let key = crate::pool::PoolKey {
            template: spec.template.clone(),
            size: spec.size,
            lane: spec.lane,
        };
        let pool = self.lock().pools.get(&key).and_then(|p| p.egress.clone());
        let pool = pool.or_else(|| self.cfg.egress.default.clone());
        let pool = pool.and_then(|p| Policy::parse(&p).ok()).unwrap_or_else(Policy::nothing);
        let effective = match &spec.egress {
            None => pool,
            Some(asked) => {
                let asked = Policy::parse(asked).map_err(|e| NodeError::new(Code::Invalid, e))?;
                match pool.narrowed(&asked) {
                    Ok(p) => p,
                    Err(_) if spec.tenant.is_none() => asked,
                    Err(why) => return Err(NodeError::new(Code::EgressWider, why)),
                }
            }
        };
        spec.egress = Some(effective.to_api());
        Ok(())
    }

    /// The lane's counters, for `/metrics`.
    pub fn egress(&self) -> Option<&Egress> {
        self.egress.get()
    }
}
