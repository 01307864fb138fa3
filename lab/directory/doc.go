// Package directory holds the lab's directory scenarios: the userwall
// agent on a testbed whose accounts come from LDAP through SSSD
// (`testbed up --directory ldap`), end to end, and the directory scale
// measurement (Scale, `palisade-lab bench directory`).
package directory
